"""The pvisor-host version, and the pinned pvisor it drives."""

__version__ = "0.1.0"

#: The pvisor-sandbox release every image and the host pre-flight use (PyPI ``pvisor-sandbox``).
PVISOR_VERSION = "0.3.1"
