"""The `nebula` command: one sub-command group per module, registered here."""

from __future__ import annotations

import typer

from nebula_common.cli import (
    account,
    audit,
    cluster,
    codec,
    compose,
    data,
    demo,
    job,
    job_view,
    local,
    login,
    pki,
    wan,
)

app = typer.Typer(
    help="Nebula: train one model across remote clusters joined by slow WAN links.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(pki.app, name="pki")
app.add_typer(wan.app, name="wan")
app.add_typer(local.app, name="local")
app.add_typer(cluster.app, name="cluster")
app.add_typer(job.app, name="job")  # with job_view's list/status/watch/logs/cancel
app.add_typer(audit.app, name="audit")
app.add_typer(codec.app, name="codec")
app.add_typer(data.app, name="data")
app.add_typer(account.app, name="account")
app.add_typer(compose.app, name="compose")
app.command("demo")(demo.demo)
app.command("login")(login.login)
app.command("logout")(login.logout)
app.add_typer(login.app, name="context")
__all__ = ["app", "job_view", "main"]


def main() -> None:
    app()


if __name__ == "__main__":
    main()
