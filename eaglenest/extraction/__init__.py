"""Extraction: prompts -> (regenerated) samples -> prefill with capture -> validated ledger.

Modules: ``config`` (the pydantic parameters), ``state`` (the extraction folder: open, prepare, plan,
persisted answers, report), ``regenerate`` (the target answers every turn in context), ``client``
(the HTTP client: lanes, retries, servers taken out), ``prefill`` (capture requests and their checks),
``aio`` (runs the client from sync code so that SIGTERM always ends it), ``validate`` (shard checks,
quarantine, the check pool), ``validator`` (a round's validation thread and what a stopped run validates),
``ledger`` (what is done), ``connect`` (servers and the run's expectations),
``stream`` (one round: regenerate -> capture -> validate as a pipeline) and ``run`` (the ONE loop, driven
by the CLI directly and by the Prefect flow through a step wrapper).
"""
