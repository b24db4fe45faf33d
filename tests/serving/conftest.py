from tests.gateway.conftest import engine, tiny_model_dir  # noqa: F401  (shared fixtures)
