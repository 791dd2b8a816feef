"""ckptd: ship every complete checkpoint off a preemptible GPU node, verified."""

__version__ = "0.1.0"
