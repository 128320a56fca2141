from eaglenest.cli import app

app()
