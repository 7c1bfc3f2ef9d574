"""``ssu bench``: backends timed side by side on one GPU against its copy ceiling.

Every available backend timed on one problem across batch sizes, on this GPU, against this GPU's
measured copy ceiling; a table, a plot, raw rows and the backend to configure.

:mod:`.measure` times one case (CUDA-graph replays on a cold L2, the median); :mod:`.report`
turns rows into the table, JSON, PNG and recommendation.
"""
