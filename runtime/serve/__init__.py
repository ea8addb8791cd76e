"""ortspec.runtime.serve: the OpenAI-compatible HTTP server (the `serve` extra).

    cli.py       `ortspec serve`: load the model, calibrate, run uvicorn (SIGTERM: graceful, exit 0)
    app.py       create_app(model, model_name=...): the FastAPI routes and error handlers
    engine.py    Admission (bounded running + waiting places), Engine (decodes in worker threads)
    protocol.py  OpenAI request checks (ApiError) and response / stream-chunk bodies
    stops.py     StopMatcher: stop strings across piece boundaries
    sse.py       EventStreamResponse: server-sent events, the generator closed on disconnect
    metrics.py   ServerMetrics: the Prometheus series (vLLM's names)

Nothing here is imported by the rest of the runtime except, lazily, the `serve` subcommand.
"""
