"""Imported first by the workers' fork server (``server.workers.process.worker_context``).

A SIGTERM to the server's whole process group (a terminal's Ctrl-C, systemd without
``KillMode=mixed``) is the server's to handle: it saves its models before it goes, so the ranks
ignore that signal (``rank.serve``) and so must the fork server, their parent, whose end the
server would read as every rank's. The fork server ends when the server does (multiprocessing
closes the pipe it waits on).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
