"""The control plane: capture and stacks requests for the ranks of a run, and their answers.

Records (``records``) travel on ``<prefix>.control``, keyed by run. ``client`` sends a
request and follows its statuses (``profstream capture``); ``stacks`` asks every rank for
its threads' stacks and merges them (``profstream stacks``); ``policy`` and ``autocapture``
turn firing alerts into requests, rate-limited per run (``profstream autocapture``), and
``webhook`` takes Alertmanager's notifications (``profstream webhook``). In the training
process, ``producers/control.py`` reads the requests and ``producers/capture_plan.py``
hands them to whatever captures ops. docs/capture.md describes it all.
"""
