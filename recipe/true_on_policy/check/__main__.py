import sys

from true_on_policy.check.cli import main

if __name__ == "__main__":
    sys.exit(main())
