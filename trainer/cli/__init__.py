"""The trainer's command line, apart from its entry module (trainer/__main__.py: parse, dispatch, one error
boundary): parser.py (the grammar and --help), evalform.py (eval's forms and their flags, pure), checks.py (what each
command refuses before torch), evalprompts.py (`eval prompts`: decoding prompt files)."""
