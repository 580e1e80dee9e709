"""The routing lab: the EPP's real scheduling code against a simulated fleet, in
virtual time.

One process, one virtual clock, no sockets, threads or sleeps. What runs is what
`epp serve` runs (the same EndpointPickerConfig files, plugins, scheduler,
datastore, prefix indexes, in-flight accounting), fed the way production feeds it
but on the virtual clock, against the simulator's engine model (`sim.engine.
EngineCore`: vLLM's scheduler loop, the paged KV cache with eviction, the step-time
model, the KV events), with every delay between them modelled:

    loop.py      the event loop: a heap of (virtual time, action)
    pod.py       a simulated pod: an engine core stepped in virtual time, its
                 metrics as a scrape would read them, its KV events
    epp.py       the EPP side: the real director, datastore and config
    peers.py     models of peer routers (SGLang's cache-aware router, Dynamo's KV
                 router) from their published algorithms
    workload.py  requests, lazily materialised (body for the router, token ids
                 for the engine); the fleet's capacity
    run.py       one (policy, seed) run and the statistics over seeds
    tenants.py   the tenants workload's flow-control figures (priorities, fairness)
    cli.py       `python -m bench lab`

Given a seed, a run is deterministic: the same inputs give the same results file.
"""
