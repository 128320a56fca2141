"""eaglenest: EAGLE-3 draft models trained on hidden states captured inside the serving engine."""

__version__ = "0.1.0"
