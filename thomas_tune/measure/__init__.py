"""Measuring candidates: the builder (:mod:`.builder`), the runner over a farm of device servers
(:mod:`.runner`), their time counters (:mod:`.phases`) and the device-side order of compiles and
timed runs (:mod:`.priority`).

This package imports none of its modules: the device server imports :mod:`.priority` alone, with
no tuning machinery.
"""
