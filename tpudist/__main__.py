"""`python -m tpudist`: the `tpudist` console script (launch, doctor)."""

from tpudist.cli import main

main()  # exits the process itself
