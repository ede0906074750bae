"""Support topics about billing and refunds, subscriptions, and orders and shipping."""

from __future__ import annotations

from demo.topic import FollowUp, Topic

_REFUND_TIME = FollowUp(
    questions=(
        "How long does the refund take?",
        "When will I see the money?",
        "How long until the refund arrives?",
        "How long will that take?",
    ),
    answer="Refunds are processed within two business days, and your bank usually shows them "
    "within five to ten business days.",
)

BILLING_TOPICS: tuple[Topic, ...] = (
    Topic(
        name="payment_method",
        area="billing",
        subjects=("credit card", "payment method", "expired card", "PayPal"),
        actions=(
            "update my credit card",
            "change my payment method",
            "add a new card",
            "update my card details",
            "pay with PayPal",
            "remove my old card",
            "change the card i pay with",
        ),
        problems=("my card expired", "i got a new credit card"),
        answers=(
            "To update your payment method, go to Settings, then Billing, and select Payment "
            "method. You can add a new card or PayPal and make it the default; your next charge "
            "uses the new method.",
        ),
        keywords=("payment", "card"),
    ),
    Topic(
        name="double_charge",
        area="billing",
        subjects=("double charge", "charged twice", "duplicate payment"),
        actions=("dispute a charge", "report a wrong charge"),
        problems=(
            "i was charged twice",
            "i see two charges on my card",
            "there's a duplicate charge on my statement",
            "you billed me twice this month",
            "there's a charge i don't recognize",
        ),
        questions=("why was i charged twice", "why is there an extra charge on my card"),
        answers=(
            "I'm sorry about that. A second charge is often a temporary hold that disappears "
            "within three business days. If both charges are still there after that, send us the "
            "dates and amounts and we'll refund the duplicate.",
        ),
        keywords=("charge", "refund"),
        followups=(_REFUND_TIME,),
    ),
    Topic(
        name="invoices",
        area="billing",
        subjects=("invoice", "invoices", "receipt", "billing history"),
        actions=(
            "download my invoices",
            "get a copy of my invoice",
            "find my receipts",
            "see my billing history",
            "get an invoice for last month",
            "print my invoice",
        ),
        problems=("i need an invoice for my company", "i can't find my receipt"),
        questions=("where are my invoices", "where can i find my receipts"),
        answers=(
            "All your invoices are in Settings, then Billing, under Billing history. Select any "
            "invoice to download it as a PDF. We also email you a receipt after every payment.",
        ),
        keywords=("invoice", "billing"),
        followups=(
            FollowUp(
                questions=(
                    "Can you add my VAT number to the invoice?",
                    "Can I put my company name on the invoice?",
                    "How do I add my tax ID?",
                ),
                answer="Yes. Add your company name and VAT number in Settings, then Billing, "
                "under Invoice details. New invoices include them, and you can regenerate past "
                "invoices from the same page.",
            ),
        ),
    ),
    Topic(
        name="refund",
        area="billing",
        subjects=("refund", "refunds", "money back"),
        actions=(
            "get a refund",
            "request a refund",
            "get my money back",
            "ask for a refund",
            "get my money back for last month",
        ),
        problems=(
            "i want my money back",
            "i was charged after i cancelled",
            "i didn't mean to renew",
        ),
        questions=("what is your refund policy", "am i eligible for a refund"),
        answers=(
            "You can request a refund within 30 days of a payment. Go to Settings, then Billing, "
            "select the payment, and choose Request refund. Approved refunds go back to your "
            "original payment method.",
        ),
        keywords=("refund",),
        followups=(_REFUND_TIME,),
    ),
    Topic(
        name="refund_status",
        area="billing",
        subjects=("refund status", "missing refund", "refund not received"),
        actions=("check the status of my refund", "track my refund"),
        problems=(
            "my refund hasn't arrived",
            "i haven't received my refund yet",
            "i'm still waiting for my refund",
        ),
        questions=("where is my refund", "when will i get my refund"),
        answers=(
            "Refunds are processed within two business days and usually show on your statement "
            "within five to ten business days. You can check the status in Settings, then "
            "Billing, next to the payment.",
        ),
        keywords=("refund",),
    ),
    Topic(
        name="payment_failed",
        area="billing",
        subjects=("failed payment", "card declined", "payment error"),
        actions=("fix a failed payment", "retry my payment"),
        problems=(
            "my payment failed",
            "my card was declined",
            "the payment didn't go through",
            "i got an email saying my payment failed",
        ),
        answers=(
            "A payment usually fails because the card expired, has too little money on it, or "
            "was blocked by the bank. Update your card in Settings, then Billing, and we'll retry "
            "the payment automatically within 24 hours.",
        ),
        keywords=("payment", "card"),
    ),
    Topic(
        name="billing_date",
        area="billing",
        subjects=("billing date", "next payment", "renewal date"),
        actions=("change my billing date", "move my payment date", "change when i get charged"),
        questions=(
            "when will i be charged next",
            "when is my next payment",
            "when does my subscription renew",
            "when is my renewal date",
        ),
        answers=(
            "Your next billing date is shown in Settings, then Billing. You can move it once per "
            "billing cycle by selecting Change billing date, and we adjust the next charge for "
            "the days in between.",
        ),
        keywords=("billing",),
    ),
    Topic(
        name="pricing",
        area="billing",
        subjects=("prices", "pricing", "premium price", "student discount"),
        actions=("see your prices", "compare the plans", "get a student discount"),
        questions=(
            "how much does the premium plan cost",
            "what are your prices",
            "how much is the annual plan",
            "is there a student discount",
            "what plans do you offer",
            "how much is premium",
            "how much does it cost",
        ),
        answers=(
            "The Basic plan is free. Premium costs 9 dollars a month or 90 dollars a year, so the "
            "annual plan saves you two months. Students get 50 percent off with a school email.",
        ),
        keywords=("plan", "premium"),
    ),
    Topic(
        name="pause_subscription",
        area="subscription",
        subjects=("pause subscription", "pausing my plan", "subscription pause"),
        actions=(
            "pause my annual subscription",
            "pause my yearly plan",
            "pause my subscription",
            "put my subscription on hold",
            "freeze my membership for a few months",
            "take a break from my subscription",
            "pause my membership",
        ),
        problems=(
            "i'm travelling for a few months and won't use my subscription",
            "i need a break from my subscription",
        ),
        answers=(
            "Yes, you can pause your subscription for up to three months, including annual "
            "plans. Go to Settings, then Subscription, and select Pause. You aren't charged "
            "while it's paused, and an annual plan is extended by the paused time.",
        ),
        keywords=("pause",),
        followups=(
            FollowUp(
                questions=(
                    "How long can I pause it for?",
                    "Is there a limit on how long I can pause?",
                    "Can I pause it for six months?",
                ),
                answer="You can pause for one, two or three months at a time, up to three "
                "months in any twelve-month period.",
            ),
            FollowUp(
                questions=(
                    "Will I lose my data while it's paused?",
                    "What happens to my files while it's paused?",
                ),
                answer="No, your data stays safe while your subscription is paused. Everything "
                "is there when you resume.",
            ),
        ),
    ),
    Topic(
        name="cancel_annual",
        area="subscription",
        subjects=("annual plan cancellation", "annual cancellation", "auto-renewal"),
        actions=(
            "cancel my annual subscription",
            "cancel my annual plan",
            "cancel my yearly subscription",
            "end my yearly plan",
            "stop my annual plan from renewing",
            "turn off auto-renewal",
        ),
        problems=("i don't want my annual plan to renew",),
        answers=(
            "You can cancel your annual plan in Settings, then Subscription, by selecting Cancel "
            "plan. You keep access until the end of the current year, and if you cancel within "
            "14 days of a renewal, you get a full refund.",
        ),
        keywords=("cancel",),
        followups=(
            FollowUp(
                questions=(
                    "Will I get a refund for the rest of the year?",
                    "Do I get money back for the unused months?",
                ),
                answer="Only if you cancel within 14 days of the renewal date. After that the "
                "plan stays active until the end of the year, but unused months are not "
                "refunded.",
            ),
        ),
    ),
    Topic(
        name="cancel_monthly",
        area="subscription",
        subjects=("cancel subscription", "cancellation", "membership cancellation"),
        actions=(
            "cancel my monthly subscription",
            "cancel my subscription",
            "stop my monthly plan",
            "end my membership",
            "stop paying for premium",
        ),
        problems=("i don't want to pay every month anymore",),
        answers=(
            "You can cancel anytime in Settings, then Subscription, by selecting Cancel plan. "
            "Your plan stays active until the end of the current billing period, and you won't "
            "be charged again.",
        ),
        keywords=("cancel",),
    ),
    Topic(
        name="upgrade",
        area="subscription",
        subjects=("upgrade", "premium upgrade", "yearly billing"),
        actions=(
            "upgrade my plan",
            "upgrade to premium",
            "switch to the annual plan",
            "switch from monthly to yearly billing",
            "change my plan to yearly",
            "get more storage",
        ),
        answers=(
            "You can upgrade in Settings, then Subscription, by selecting Change plan. The "
            "upgrade starts right away, and you only pay the difference for the rest of the "
            "current billing period.",
        ),
        keywords=("upgrade",),
    ),
    Topic(
        name="downgrade",
        area="subscription",
        subjects=("downgrade", "cheaper plan", "free plan"),
        actions=(
            "downgrade my plan",
            "switch to a cheaper plan",
            "switch to the free plan",
            "go back to the basic plan",
        ),
        answers=(
            "You can downgrade in Settings, then Subscription, by selecting Change plan. The "
            "change takes effect at the start of your next billing period, and you keep your "
            "current features until then.",
        ),
        keywords=("downgrade",),
    ),
    Topic(
        name="resume_subscription",
        area="subscription",
        subjects=("resume subscription", "paused subscription", "reactivation"),
        actions=(
            "resume my subscription",
            "unpause my subscription",
            "reactivate my subscription",
            "restart my membership",
        ),
        problems=(
            "my subscription is paused and i want it back",
            "i'm back from my trip and want my subscription again",
        ),
        answers=(
            "Welcome back! Go to Settings, then Subscription, and select Resume. Your plan "
            "starts again right away, and your next billing date moves forward by the paused "
            "time.",
        ),
        keywords=("resume", "subscription"),
    ),
    Topic(
        name="free_trial",
        area="subscription",
        subjects=("free trial", "trial", "trial period"),
        actions=("start a free trial", "try premium for free", "cancel my free trial"),
        questions=(
            "how long is the free trial",
            "will i be charged after the free trial",
            "is there a free trial",
        ),
        answers=(
            "The free trial lasts 14 days and includes every Premium feature. We remind you three "
            "days before it ends, and you can cancel anytime during the trial without being "
            "charged.",
        ),
        keywords=("trial",),
    ),
    Topic(
        name="track_order",
        area="shipping",
        subjects=("order status", "tracking", "late package"),
        actions=("track my order", "track my package", "check the status of my order"),
        problems=(
            "my package hasn't arrived",
            "my order is late",
            "my order still hasn't shipped",
            "the tracking hasn't updated in days",
        ),
        questions=("where is my order", "where is my package", "when will my order arrive"),
        answers=(
            "You can track your order in Orders, where each shipment has a tracking link. Orders "
            "usually ship within two business days. If the tracking hasn't changed for five "
            "days, tell us and we'll open an investigation with the carrier.",
        ),
        keywords=("order", "track"),
    ),
    Topic(
        name="change_address",
        area="shipping",
        subjects=("wrong address", "delivery address", "shipping address"),
        actions=(
            "change my shipping address",
            "update the delivery address for my order",
            "send my order to a different address",
            "fix the address on my order",
        ),
        problems=("i entered the wrong address", "i moved and my address is wrong"),
        answers=(
            "You can change the shipping address in Orders until the order ships: select the "
            "order and choose Edit address. If it has already shipped, contact the carrier with "
            "your tracking number to redirect it.",
        ),
        keywords=("address",),
    ),
    Topic(
        name="shipping_info",
        area="shipping",
        subjects=("shipping", "shipping costs", "delivery times", "international shipping"),
        actions=("get free shipping", "ship to another country", "get express delivery"),
        questions=(
            "how long does shipping take",
            "how much does shipping cost",
            "do you ship internationally",
            "do you offer express shipping",
            "which countries do you ship to",
        ),
        answers=(
            "Standard shipping takes three to five business days and is free on orders over 50 "
            "dollars. Express shipping takes one to two days. We ship to over 40 countries, and "
            "international orders take seven to fourteen days.",
        ),
        keywords=("shipping",),
    ),
    Topic(
        name="returns",
        area="shipping",
        subjects=("returns", "return policy", "exchange"),
        actions=(
            "return an item",
            "send back a product",
            "exchange an item for a different size",
            "return my order",
            "start a return",
        ),
        questions=("what is your return policy", "can i return something i bought"),
        answers=(
            "You can return most items within 30 days of delivery. Go to Orders, select the "
            "item, and choose Return or exchange. We email you a free return label, and your "
            "refund is issued once the item reaches our warehouse.",
        ),
        keywords=("return",),
    ),
    Topic(
        name="damaged_item",
        area="shipping",
        subjects=("damaged item", "broken product", "wrong item"),
        actions=("report a damaged item", "replace a broken product"),
        problems=(
            "my item arrived damaged",
            "i received the wrong item",
            "something is missing from my order",
            "the product is broken",
            "the box was crushed and the item is damaged",
        ),
        answers=(
            "I'm sorry about that. Please send us a photo of the item and your order number from "
            "the Orders page. We'll ship a replacement right away or refund you, whichever you "
            "prefer, and you don't need to send the item back.",
        ),
        keywords=("replacement", "order", "photo"),
    ),
)
