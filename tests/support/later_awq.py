"""AWQ as a later release of the factory might ship it, taking BertModel too
(FACTORY_ENGINES=tests.support.later_awq:ENGINE replaces the built-in one in that process): what a watch that skipped a
BERT release meets on a later check."""

from factory.engines.awq.engine import AwqEngine


class LaterAwq(AwqEngine):
    architectures = AwqEngine.architectures | {"BertModel"}


ENGINE = LaterAwq()
