import sys

from vllm_artifact.selftest.runner import main

sys.exit(main())
