"""``sealfl device serve``: the main thread (:mod:`.server`), the HTTP front (:mod:`.app`),
request parsing (:mod:`.openai_api`), shared state (:mod:`.state`) and metrics
(:mod:`.metrics`). Part of the device runtime's measurement."""
