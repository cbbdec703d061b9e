import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tt03_jobs, also for spawned ranks
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: rank pools, tests_support
