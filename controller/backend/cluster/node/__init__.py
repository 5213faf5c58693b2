"""What runs on, or asks, the nodes of a cluster: the Ray tasks (:mod:`.tasks`), ``node join`` (:mod:`.join`),
``cluster status`` (:mod:`.status`)."""
