"""What keeps the course safe but teaches nothing: a chapter calls each piece once, by name.

You need not read this package to follow a chapter. It holds the one-line failures (errors.py),
the run-folder lock (rundir.py) and similar guards.
"""
