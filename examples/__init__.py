"""Run configs shipped with Reel: `reel example list|copy` hands them out (runtime/package_files.py).

Data only; a marker file so that importlib.resources finds them in a wheel and an editable install alike.
"""
