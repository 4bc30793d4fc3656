"""The web console at ``/console``: runs, their loss curves and checkpoints, and (for operator
keys) the server's health, as HTML pages rendered on the event loop from the services the API
routes use. ``routes`` is HTTP only, ``views`` gathers what a page shows, ``signin`` is the
cookie that stands for a key; ``templates/`` and ``static/`` ship in the package (no CDN)."""
