"""Notebook views: the run form and the live job view (thin views over workbench's library calls)."""

from workbench.widgets.chat import ChatWidget
from workbench.widgets.job_view import JobView
from workbench.widgets.run_form import RunForm

__all__ = ["ChatWidget", "JobView", "RunForm"]
