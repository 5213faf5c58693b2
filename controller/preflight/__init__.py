"""Pre-flight: everything decided on the host before a sandbox may start, cheapest check first."""
