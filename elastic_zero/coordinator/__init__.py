"""The coordinator: a pure state machine (state.py) and the Ray actor that carries out its commands."""
