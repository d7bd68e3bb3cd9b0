"""Message size limits of every profstream client, topic and the bundled broker, in one place.

- ``MAX_MESSAGE_BYTES``: the largest message a profstream client produces or forwards,
  Kafka's default limit, so that a stock cluster takes all of them. It is also the size of
  a producer's batch of messages, framing included. The Monitor splits a batch that would
  encode larger; the processor forwards a larger dead letter truncated.
- ``TOPIC_MAX_MESSAGE_BYTES``: what the topics profstream creates, and the bundled broker,
  accept: a full batch with room for its framing.
- ``DEAD_LETTER_ROOM_BYTES``: kept free for the key and headers of a dead letter.
"""

MAX_MESSAGE_BYTES = 1024 * 1024
TOPIC_MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES + 64 * 1024
DEAD_LETTER_ROOM_BYTES = 16 * 1024
