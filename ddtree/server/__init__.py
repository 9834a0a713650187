"""The OpenAI-compatible DDTree server: `ddtree serve`, or `create_app(llm)` for any ASGI server."""


def __getattr__(name):
    # FastAPI and friends load only when the server is used, not on every `ddtree` command.
    if name == "create_app":
        from ddtree.server.app import create_app

        return create_app
    raise AttributeError(f"module 'ddtree.server' has no attribute {name!r}")


__all__ = ["create_app"]
