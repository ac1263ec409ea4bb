"""LSE core: models, templates, the op graph, the device contract, the engine and the request API."""
