"""Course mode: a class on JupyterHub where each student has a credit they cannot overspend.

The modules follow the money: :mod:`~workbench.course.config` (the course file, the hub config),
:mod:`~workbench.runs.ledger` (append-only rows in a database, shared with the single-user wallet),
:mod:`~workbench.course.policy` (what a spec may name, caps, the course's prices),
:mod:`~workbench.course.students` (each student's space; work started as the student through
sudo) and :mod:`~workbench.course.worker` (that work, run as the student),
:mod:`~workbench.course.meter` (the service's meter of students' attempts),
:mod:`~workbench.course.desk` (hold, launch, settle), :mod:`~workbench.course.service` (the hub
service's REST routes) and :mod:`~workbench.course.client` (the student's kernel side).
See docs/course.md.
"""
