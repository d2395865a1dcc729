"""terminal: what reaches a person's terminal, at the bottom of the layers so every package can use it.

Lives here: progress of long actions (`progress`), text from input files made safe to print
(`text`), and the root of the user-facing errors whose one-paragraph message the CLI prints
(`errors`). Imports nothing of the project.
"""
