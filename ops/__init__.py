"""Operations files shipped with Reel: the Slurm job template, redis.conf, Prometheus and Grafana configs.

Data only (runtime/package_files.py finds them); a marker file so that importlib.resources finds them in a
wheel and an editable install alike. The install and test scripts here are not shipped.
"""
