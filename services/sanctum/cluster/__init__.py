"""Ray only: the role actors, the front end's ClusterBackend, the role proxies and the channels
between processes (shared memory, Unix sockets, the object store). Built on serving/ and
wire/; it never imports api/."""
