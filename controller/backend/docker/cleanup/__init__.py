"""The cleanup stage: leftovers of controllers that are gone (``gc``), and the images and runtime volumes
pvisor-host made, with their last use (``images``, ``images prune``)."""
