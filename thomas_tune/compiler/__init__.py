"""The compiler stage: a tuning log made into the libraries of an export, its records checked first.

In: the graphs of :mod:`thomas_tune.training_graph`, their tasks (:mod:`thomas_tune.tasks`) and a
tuning log (:mod:`thomas_tune.logs`, written by :mod:`thomas_tune.tuning`). Out: an export folder
(``inference.so``, ``train.so``, ``params.npz``, ``manifest.json``, :mod:`thomas_tune.manifest`)
that :mod:`thomas_tune.runtime` loads. No earlier stage imports this package.

Modules:

* :mod:`.build_plan`: what a build with a log compiles its graphs with (applied and slower
  records, kernel times, the Winograd choice, the tasks), made once; rebuilt without wrong records;
* :mod:`.record_check`: each record a plan applies, run once on a device of this machine against
  its task's default schedule; the wrong ones are returned and set aside;
* :mod:`.compile`: a Relax graph compiled for a target with a log's schedules;
* :mod:`.export`: the inference and the training library, parameters and manifest, written out;
* :mod:`.replay`: a build from a log with no device: coverage and the numeric checks.
"""
