"""The service's routes, one module per resource (STYLE.md: the door is thin)."""
