# docs/cli.md's train.py, for the pages that run it without showing it again (docs/distributed.md)
from mypkg import RegressionData, Regressor

from trainkit.cli import main

if __name__ == "__main__":
    main(Regressor, RegressionData)
