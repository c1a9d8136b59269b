"""One `tierzero train` run, the parts train.py puts together:

    folder.py   the run folder: its lock, what it may already hold, its files, disk errors
    loop.py     the steps: resume, the optimizer's step, checkpoints, metrics rows
    report.py   the end files: summary.json and the failure record
    outputs.py  where the run's exports go, checked before the first step
    plots.py    tiers.png
    stop.py     SIGTERM and SIGINT stop at a step boundary
"""
