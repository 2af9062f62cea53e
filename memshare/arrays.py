"""Arrays allocated in shared memory by the user (filled in below)."""


def lookup_shared(ref):
    return None
