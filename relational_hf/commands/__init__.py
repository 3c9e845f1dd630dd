"""The `relational-hf` commands, one module each (`main.COMMANDS`), and how they declare options (`options`) and
check inputs (`checks`). `relational_hf.commands.main:main` is the console entry point; the library packages below
parse no arguments."""
