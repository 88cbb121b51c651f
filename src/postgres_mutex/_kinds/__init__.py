"""The lock kinds (Mutex, Semaphore, RWLock) and what a holder is made of.

Internal: nothing here is public API; the public names are the package's.
"""
