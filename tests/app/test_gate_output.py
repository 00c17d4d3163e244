"""``output_to``: everything a gate's runs print goes to its log, and every stream is put back, even
where a library's console handler was made inside the block and bound to it."""

from __future__ import annotations

import logging
import sys

from amp_plugin.app.gate_output import output_to


def test_a_handler_made_inside_the_block_survives_the_log_being_closed(tmp_path, capfd):
    # transformers' logging does this at import: a StreamHandler on sys.stderr with its flush bound to
    # sys.stderr.flush, and Lightning imports transformers where it is installed.
    logger = logging.getLogger("tests.gate_output.library")
    logger.propagate = False
    first = open(tmp_path / "first.log", "w")  # noqa: SIM115 (closed below, as the gate closes its scratch file)
    try:
        with output_to(first):
            handler = logging.StreamHandler()
            handler.flush = sys.stderr.flush  # type: ignore[method-assign]
            logger.addHandler(handler)
            logger.warning("inside the first block")
        first.close()
        logger.warning("after the first block")  # to the real stderr, flushing it (not the closed file)
        with open(tmp_path / "second.log", "w") as second, output_to(second):
            logger.warning("inside the second block")
        logger.warning("after the second block")
    finally:
        logger.handlers.clear()
    assert (tmp_path / "first.log").read_text() == "inside the first block\n"
    assert (tmp_path / "second.log").read_text() == "inside the second block\n"
    assert capfd.readouterr().err == "after the first block\nafter the second block\n"


def test_handlers_made_before_the_block_write_to_the_log_inside_it_and_back_after(tmp_path, capfd):
    logger = logging.getLogger("tests.gate_output.before")
    logger.propagate = False
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        with open(tmp_path / "run.log", "w") as log, output_to(log):
            logger.warning("to the log")
            print("printed")
        logger.warning("to stderr")
    finally:
        logger.handlers.clear()
    assert (tmp_path / "run.log").read_text() == "to the log\nprinted\n"
    assert capfd.readouterr().err == "to stderr\n" and handler.stream is sys.stderr
