"""Course mode: a class on JupyterHub where each student has a credit they cannot overspend.

The modules follow the money: :mod:`~workbench.course.config` (the course file, the hub config),
:mod:`~workbench.course.ledger` (append-only rows in a database),
:mod:`~workbench.course.policy` (caps and the course's prices applied to a spec),
:mod:`~workbench.course.desk` (hold, launch, settle), :mod:`~workbench.course.service` (the hub
service's REST routes) and :mod:`~workbench.course.client` (the student's kernel side).
See docs/course.md.
"""
