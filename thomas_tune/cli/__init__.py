"""The ``thomas-tune`` command, one module per verb group.

:mod:`.main` (the parser and :func:`main`, the console entry point ``thomas_tune.cli:main``, and
the ``demo``), :mod:`.options` (the model, target and device-server options several verbs
share), :mod:`.stop` (stopping by signal), :mod:`.tune` (``tasks``, ``tune``, ``remeasure``),
:mod:`.device` (``rpc``), :mod:`.export` (``export``, ``replay``), :mod:`.run` (``train``,
``infer``), :mod:`.model` (``import-onnx``, ``memory``), :mod:`.bench` (``bench``), :mod:`.log`
(``log show|check|merge|pack|unpack``).
"""

from .main import main, parser

__all__ = ["main", "parser"]
