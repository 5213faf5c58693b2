"""The commands, one module per group: :mod:`.run` (``replay``, ``batch``), :mod:`.images` (``build``,
``images``), :mod:`.results` (``compare``, ``report``), :mod:`.host` (``agents``, ``doctor``, ``gc``) and
:mod:`.cluster` (``node join``, ``cluster status``). Each has a ``register(app)``."""
