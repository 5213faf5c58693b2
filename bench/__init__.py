"""The benchmark behind ``make bench`` (``python -m bench``, from the repository's root): pvisor-host side by
side with plain Docker. One module per section; the entry, its sections and options in ``__main__``; the
helpers they share in ``common``."""
