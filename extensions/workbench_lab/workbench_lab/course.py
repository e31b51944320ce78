"""The panel's course view: the student's credit (balance, held, spent) and, for an instructor,
every student's account with a grant, read from the course service when the server runs under a
course hub (``WORKBENCH_COURSE_URL`` set by the hub config, the server's own hub token).

    GET  /workbench/api/course         {"course": false} | {"course": true, "me": ..., "students"}
    POST /workbench/api/course/grant   instructors: {"student", "amount", "note"}
"""

from __future__ import annotations

import os
from typing import Any


def course_panel(client: Any = None) -> dict[str, Any]:
    """What the panel draws: the service's /me, and /students for an instructor."""
    if client is None:
        if not os.environ.get("WORKBENCH_COURSE_URL"):
            return {"course": False}
        from workbench.course.client import CourseClient

        client = CourseClient()
    me = client.me()
    per = int(me.get("minor_per_unit") or 100)
    out: dict[str, Any] = {"course": True, "user": me["user"], "instructor": me["instructor"],
                           "currency": me["currency"]}
    if "balance" in me:  # a student: amounts in currency units for people
        out["me"] = {"balance": me["balance"] / per, "held": me["held"] / per,
                     "spent": me["charges"] / per, "granted": (me["credits"] + me["grants"]) / per,
                     "runs": [{"run": r["run"], "kind": r.get("kind"), "state": r.get("state"),
                               "hold": r["hold"] / per,
                               "charge": None if r["charge"] is None else r["charge"] / per}
                              for r in me.get("runs", [])]}
    if me["instructor"]:
        table = client.students()
        out["students"] = [{"student": s["student"], "balance": s["balance"] / per,
                            "held": s["held"] / per, "spent": s["charges"] / per,
                            "granted": (s["credits"] + s["grants"]) / per, "runs": s["runs"],
                            "running": s["running"]} for s in table["students"]]
    return out


def course_grant(body: Any, client: Any = None) -> dict[str, Any]:
    from workbench.errors import CourseError

    if not isinstance(body, dict) or not isinstance(body.get("student"), str):
        raise CourseError('give {"student": NAME, "amount": N, "note": "..."}')
    try:
        amount = float(body["amount"])
    except (KeyError, TypeError, ValueError):
        raise CourseError("amount must be a number of currency units, e.g. 5") from None
    if client is None:
        from workbench.course.client import CourseClient

        client = CourseClient()
    client.grant(body["student"], amount, str(body.get("note") or ""))
    return course_panel(client)
