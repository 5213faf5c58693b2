"""The image a sandbox runs: bases (:mod:`.base`), content-addressed builds (:mod:`.recipe`), versions probed
inside an image (:mod:`.probe`), which image a request gets (:mod:`.resolve`) and runtime volumes for task
images (:mod:`.inject`)."""
