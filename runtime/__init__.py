"""Runtime: Ray host-actors and the interpreter that runs instruction streams (installed as ``meshshard.runtime``)."""
