"""The service's routes, one module per resource (each thin: it reads the request with the
command line's own code and hands it on)."""
