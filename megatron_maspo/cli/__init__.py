"""The ``maspo`` command line."""
