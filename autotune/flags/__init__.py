"""Every command's flags, as data: one row per flag (`flag.Flag`) in the tables of `table.py`, the
kinds of values they take (`values.py`) and how their values become the library's arguments
(`arguments.py`). Both doors are made from these tables: the command line decorates its commands
with them (`flag.options`), and the service reads a request's body with a command built from the
same rows (`flag.reading_command`), so neither spells a flag again nor imports the other."""
