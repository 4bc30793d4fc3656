"""The training backend in a worker process, so that it can die without taking the server along.

``process.WorkerProcess`` is one child process and the pipe to it; ``rank.serve`` is the loop
that runs in it; ``backend.ProcessBackend`` is what the server holds: the ranks' declared calls
(``core.calls.calls_to``: ``backend.trainer``, ``backend.sampler``), carried over the pipe, with
a new worker group (and restored models) after a death.
"""
