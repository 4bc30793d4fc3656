"""The training backend in a worker process, so that it can die without taking the server along.

``process.WorkerProcess`` is one child process and the pipe to it; ``child.serve`` is the
loop that runs in it; ``backend.ProcessBackend`` is what the server holds: the backend
interface, carried over the pipe, with a new worker (and restored models) after a death.
"""
