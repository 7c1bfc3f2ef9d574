"""The ``ssu`` command line (see ``ssu --help``)."""
