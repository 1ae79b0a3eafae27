from aligntax.cli import app

app(prog_name="aligntax")
